"""The notebooks in a real browser, as close to Colab as runs offline: headless Chromium (Debian's package,
nothing downloaded) on a local classic Jupyter server with Colab's ipywidgets 7.7.1, the stand-in google.colab
and TINYGPT_SMOKE=1. Each notebook is run all; what the page shows is returned as observations (for
tests/test_browser.py) and photographed (docs/images/, shown in the README).

    TINYGPT_SCREENSHOTS=docs/images python -m pytest tests/test_browser.py   # refresh the README's screenshots

(tests/test_browser.py checks what each picture must show, then copies them there; `python
tests/browser_colab.py --images DIR` takes the pictures without the checks.) The finetuning notebook starts
from a base that has learned something: `cpu-smoke` pretrained for 400 steps (about a CPU minute) in
the stand-in Drive, where smoke mode looks for its base (smoke mode's own base has 20 steps). Before
finetuning it answers with blank lines; after 6 finetuning steps it begins a Python function, not yet a
working one (tests/test_browser.py checks that the answers changed).

The front end lives in a private environment (.cache/browser-venv-X.Y, one per Python: the classic notebook,
ipywidgets 7.7.1, selenium) that sees this environment's packages (torch, transformers...) behind its own, so the kernel runs
this checkout with Colab's widget versions. This file runs twice: in this environment it builds that
environment and starts itself again inside it, where it drives the browser.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# one per Python: CI's two suites run on different Pythons, and a folder rebuilt for one while the other's kernel
# starts from it loads the wrong torch ("Failed to load PyTorch C extensions")
VENV = ROOT / ".cache" / f"browser-venv-{sys.version_info.major}.{sys.version_info.minor}"
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
# Colab's front-end versions come from constraints/colab.txt; selenium drives Debian's chromedriver
FRONT_END = [
    "notebook",
    "ipywidgets",
    "widgetsnbextension",
    "ipykernel",
    "jupyter_client",
    "traitlets",
    "selenium>=4.20",
]
CHROME_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--window-size=1100,2400",
    "--hide-scrollbars",
]
CELL_TIMEOUT_S = 300
STARTUP_S = 180  # the server, a kernel: seconds on a loaded 2-core machine (CI's other worker trains meanwhile)


def missing_browser() -> str | None:
    """Why the browser run cannot happen here, or None."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        return "Debian's headless Chromium is not installed (apt-get install -y chromium chromium-driver)"
    return None


# ---- in this environment: the private front-end environment, then the run inside it -----------------------


def browser_python() -> Path:
    """The private environment's python, built (once per front-end list and constraints) under .cache/."""
    stamp = hashlib.sha256(
        json.dumps(
            [FRONT_END, (ROOT / "constraints" / "colab.txt").read_text(), sys.version]
        ).encode()
    ).hexdigest()
    python = VENV / "bin" / "python"
    VENV.parent.mkdir(parents=True, exist_ok=True)
    # one builder at a time: pytest-xdist workers that start a browser test together wait for it
    with open(VENV.parent / f"{VENV.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ((VENV / "stamp").is_file() and (VENV / "stamp").read_text() == stamp):
            shutil.rmtree(VENV, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=300)
            subprocess.run(
                [
                    str(python),
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "-c",
                    str(ROOT / "constraints" / "colab.txt"),
                    *FRONT_END,
                ],
                check=True,
                timeout=900,
            )
            (VENV / "stamp").write_text(stamp)
    # this environment's packages behind the private ones (a .pth appends them; its own .pth files are not run),
    # written at every call: CI runs the suite in two environments (newest, Colab's pins) over one checkout,
    # and the notebooks must run on the packages of the suite that runs them
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "outer-env.pth").write_text(
        "\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n"
    )
    return python


SHOWCASE_BASE = (
    "cpu-smoke",
    400,
)  # the finetuning notebook's base: recipe and steps (about a CPU minute)


def showcase_base(env: dict[str, str]) -> Path:
    """A base for 02_finetune that has learned something, where smoke mode looks for its base (the Colab
    stand-in's Drive, tinygpt/runs/smoke-base); made once per Drive folder."""
    recipe, steps = SHOWCASE_BASE
    run = Path(env["TINYGPT_FAKE_DRIVE_ROOT"]) / "MyDrive" / "tinygpt" / "runs" / "smoke-base"
    if (run / "checkpoints" / f"step_{steps:06d}").is_dir():
        return run
    cmd = [
        sys.executable,
        "-m",
        "tinygpt",
        "pretrain",
        "--recipe",
        recipe,
        "--max-steps",
        str(steps),
        "--save-every",
        str(steps),
        "--eval-every",
        str(steps // 4),
        "--run-dir",
        str(run),
        "--quiet",
        "--device",
        "cpu",
    ]
    subprocess.run(
        cmd,
        env={**env, "OMP_NUM_THREADS": str(os.cpu_count() or 1)},
        check=True,
        timeout=1800,
        stdout=subprocess.DEVNULL,
    )
    return run


def run_in_browser(env: dict[str, str], out: Path, notebooks: list[str] | None = None) -> dict:
    """Run the notebooks in Chromium under `env` (a Colab stand-in's variables); screenshots and
    observations.json go to `out`. The observations, by notebook."""
    out.mkdir(parents=True, exist_ok=True)
    if "02_finetune.ipynb" in (notebooks or ALL):
        showcase_base(env)
    cmd = [str(browser_python()), str(Path(__file__).resolve()), "--inside", "--out", str(out)]
    log = out / "inside.log"
    with open(log, "wb") as f:
        p = subprocess.run(
            cmd + (["--notebooks", *notebooks] if notebooks else []),
            env=env,
            timeout=1800,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    if (
        p.returncode != 0
    ):  # the run's own last words in the failure (pytest repeats a module fixture's error),
        said = log.read_text(
            errors="replace"
        )  # its last line first: pytest's one-line summary shows it
        last = next((line for line in reversed(said.splitlines()) if line.strip()), "")
        raise RuntimeError(
            f"the browser run failed (exit {p.returncode}): {last[:300]}\nthe end of {log}:\n"
            + said[-4000:]
        )
    return json.loads((out / "observations.json").read_text())


# ---- inside the private environment: the server, the browser and the notebooks -----------------------------


class Notebook:
    """One open notebook page, driven through the classic notebook's own JavaScript API."""

    def __init__(self, driver, url: str, path: Path):
        self.driver, self.path = driver, path
        self.ids = [c.get("id") for c in json.loads(path.read_text())["cells"]]
        driver.get(url)
        # and the widget manager listening (ipywidgets 7's extension gives the kernel one when it registers for
        # widgets): a widget a cell makes before then is dropped by the page, as a user who runs a cell before the
        # page has loaded would see
        self.wait(
            "return !!(window.Jupyter && Jupyter.notebook && Jupyter.notebook._fully_loaded"
            " && Jupyter.notebook.kernel && Jupyter.notebook.kernel.is_connected()"
            " && Jupyter.notebook.kernel.widget_manager)",
            STARTUP_S,
            "the kernel to start and the widget manager to listen",
        )
        self.js("Jupyter.notebook.set_autosave_interval(0)")  # never write outputs into the copy

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def wait(self, script: str, timeout: float, what: str, *args) -> None:
        end = time.monotonic() + timeout
        while not self.js(script, *args):
            if time.monotonic() > end:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}")
            time.sleep(0.25)

    def index(self, cell_id: str) -> int:
        return self.ids.index(cell_id)

    def run(self, cell_ids: list[str] | None = None) -> None:
        """Run all cells (or these ones) and wait until the kernel is idle with nothing queued."""
        if cell_ids is None:
            self.js("Jupyter.notebook.execute_all_cells()")
        else:
            self.js(
                "Jupyter.notebook.execute_cells(arguments[0])", [self.index(c) for c in cell_ids]
            )
        idle = (
            "return !Jupyter.notebook.get_cells().some(c => c.input_prompt_number === '*')"
            " && document.querySelector('#kernel_indicator_icon').classList.contains('kernel_idle_icon')"
        )
        for _ in range(
            2
        ):  # idle twice in a row: between two queued cells the kernel is idle for an instant
            self.wait(
                idle, CELL_TIMEOUT_S * max(1, len(cell_ids or self.ids)), "the cells to finish"
            )
            time.sleep(1.0)
        errors = self.js(
            "return [...document.querySelectorAll('.output_error')].map(e => e.innerText)"
        )
        if errors:
            raise RuntimeError(f"{self.path.name}: a cell failed:\n" + "\n".join(errors)[-3000:])

    def output(self, cell_id: str):
        return self.js(
            "return Jupyter.notebook.get_cell(arguments[0]).output_area.element[0]",
            self.index(cell_id),
        )

    def text(self, cell_id: str) -> str:
        return self.output(cell_id).get_attribute("innerText")

    def set_source(self, cell_id: str, source: str) -> None:
        self.js(
            "Jupyter.notebook.get_cell(arguments[0]).set_text(arguments[1])",
            self.index(cell_id),
            source,
        )

    def watch_images(self, cell_id: str) -> None:
        """Record, while the cell runs, how many images its output holds at once and how many different
        pictures it showed: a plot that updates in place is one image with several pictures."""
        self.js(
            """const el = arguments[0]; window.__plot = {most: 0, pictures: new Set(), bars: 0};
                   new MutationObserver(() => { const imgs = el.querySelectorAll('img');
                       window.__plot.most = Math.max(window.__plot.most, imgs.length);
                       imgs.forEach(i => window.__plot.pictures.add(i.src.length + ':' + i.src.slice(-64)));
                       // the progress widget while it runs (when it closes it becomes its final text line)
                       window.__plot.bars = Math.max(window.__plot.bars,
                           el.querySelectorAll('.widget-hprogress, progress').length); })
                   .observe(el, {childList: true, subtree: true, attributes: true});""",
            self.output(cell_id),
        )

    def watched_images(self) -> dict:
        return self.js("return {most: window.__plot.most, pictures: window.__plot.pictures.size}")

    def watched_bars(self) -> int:
        """The most progress widgets the watched cell showed at once while it ran."""
        return self.js("return window.__plot.bars")

    def screenshot(self, first: str, last: str, path: Path) -> None:
        """A picture of the outputs of cells `first` to `last` (what the user sees under them). The classic
        notebook scrolls inside its own panel, so the first output is scrolled to the top of the window."""
        box = self.js(
            """arguments[0].scrollIntoView(); const a = arguments[0].getBoundingClientRect(),
                         b = arguments[1].getBoundingClientRect();
                         return {x: a.left, y: a.top, width: a.width,
                                 height: Math.min(b.bottom, innerHeight) - a.top, scale: 1};""",
            self.output(first),
            self.output(last),
        )
        shot = self.driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "clip": box})
        path.write_bytes(base64.b64decode(shot["data"]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder: Path, work: Path) -> tuple[subprocess.Popen, str]:
    """The classic notebook server on a free local port, serving `folder`; (process, base url)."""
    port, token = free_port(), hashlib.sha256(os.urandom(16)).hexdigest()[:32]
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(work / "config"),
        "JUPYTER_DATA_DIR": str(work / "data"),
        "JUPYTER_RUNTIME_DIR": str(work / "runtime"),
        "IPYTHONDIR": str(work / "ipython"),
    }
    log = open(work / "server.log", "wb")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "notebook",
            "--no-browser",
            "--allow-root",
            f"--port={port}",
            "--ip=127.0.0.1",
            f"--NotebookApp.token={token}",
            f"--notebook-dir={folder}",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + STARTUP_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, f"{url}/notebooks/{{name}}?token={token}"
        except OSError:
            if server.poll() is not None or time.monotonic() > end:
                raise RuntimeError(
                    f"the notebook server did not start:\n{(work / 'server.log').read_text()[-2000:]}"
                )
            time.sleep(0.5)


def chromium(work: Path):
    """The browser, started once more if the first start fails: on a loaded machine Chromium can miss
    chromedriver's start-up deadline ("session not created"), which says nothing about the notebooks."""
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service

    for attempt in (1, 2):
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in CHROME_FLAGS + [f"--user-data-dir={work / f'chromium-profile-{attempt}'}"]:
            options.add_argument(flag)
        options.set_capability(
            "goog:loggingPrefs", {"browser": "ALL"}
        )  # the page's console, kept for a failure
        try:
            return webdriver.Chrome(
                service=Service(executable_path=str(CHROMEDRIVER)), options=options
            )
        except WebDriverException as e:
            if attempt == 2:
                raise
            print(
                f"Chromium did not start ({str(e).splitlines()[0][:200]}); starting it again",
                flush=True,
            )


def dropdown(nb: Notebook, cell_id: str, wait_s: float = 600.0, redraw_s: float = 180.0):
    """The cell's dropdown, once the front end has drawn it (after its cell ran: later on a busy machine).

    The classic notebook (the stand-in for Colab's front end) under load has twice created a cell's widget
    models and drawn no view of them (the recipe cell empty, 42 models in the page). After `redraw_s` the
    cell is run once more, as a user would, and the page's console errors are printed to the run's log;
    a cell that still shows no dropdown fails with what it showed and the console's errors."""
    deadline, rerun = time.monotonic() + wait_s, time.monotonic() + redraw_s
    while not (
        found := nb.output(cell_id).find_elements("css selector", ".widget-dropdown select")
    ):
        if rerun is not None and time.monotonic() > rerun:
            print(f"no view drawn in cell {cell_id!r} after {redraw_s:.0f} s; console errors:")
            print("\n".join(console_errors(nb)) or "(none)", flush=True)
            nb.run([cell_id])
            rerun = None
        if (
            time.monotonic() > deadline
        ):  # say what the cell showed instead: an error, a text fallback
            models = nb.js(
                "const m = Jupyter.notebook.kernel.widget_manager;"
                " return m ? Object.keys(m._models).length : 'no widget manager'"
            )
            raise AssertionError(
                f"no dropdown in cell {cell_id!r} after {wait_s:.0f} s (widget models in the "
                f"page: {models}); it shows: {nb.text(cell_id)[:1500]!r}; console errors: "
                + " | ".join(console_errors(nb))[-1500:]
            )
        time.sleep(0.5)
    return found[0]


def console_errors(nb: Notebook) -> list[str]:
    """The page's console messages of level SEVERE since the last call (chromedriver hands each once)."""
    return [e["message"] for e in nb.driver.get_log("browser") if e.get("level") == "SEVERE"]


def pretrain(nb: Notebook, out: Path) -> dict:
    """01_pretrain: run all untouched, then a new run with another recipe picked in the dropdown."""
    from selenium.webdriver.support.ui import Select

    seen: dict = {}
    nb.watch_images("train")
    nb.run()
    select = dropdown(nb, "recipe")
    seen["default"] = Select(select).first_selected_option.text
    seen["options"] = [o.text for o in Select(select).options]
    # what each of the cell's dropdowns shows (recipe, time, size, base): "" for one drawn empty
    # (ipywidgets 7 writes the labels' spaces as no-break spaces)
    seen["shown"] = [
        nb.js(
            "const s = arguments[0]; return s.selectedIndex < 0 ? '' : s.options[s.selectedIndex].text",
            s,
        ).replace("\xa0", " ")
        for s in nb.output("recipe").find_elements("css selector", ".widget-dropdown select")
    ]
    seen["plot"] = nb.watched_images()
    seen["progress_bars"] = nb.watched_bars()
    seen["train"], seen["samples"] = nb.text("train"), nb.text("samples")
    nb.screenshot("recipe", "recipe", out / "pretrain-recipe-picker.png")
    nb.screenshot("train", "train", out / "pretrain-training.png")
    # a second run, as the notebook tells a user: a new RUN_NAME, then another recipe in the dropdown
    source = nb.js("return Jupyter.notebook.get_cell(arguments[0]).get_text()", nb.index("run"))
    nb.set_source("run", source.replace('RUN_NAME = "my-first-gpt"', 'RUN_NAME = "second-gpt"'))
    nb.run(["run", "recipe"])
    select = dropdown(nb, "recipe")
    seen["default_second"] = Select(select).first_selected_option.text
    other = next(o for o in Select(select).options if o.text.split()[0] == "cpu")
    other.click()
    time.sleep(0.5)  # the change travels to the kernel over the widget channel
    seen["picked"] = Select(select).first_selected_option.text
    nb.run(["train"])
    seen["train_second"] = nb.text("train")
    return seen


def run_notebooks(out: Path, names: list[str]) -> dict:
    work = Path(tempfile.mkdtemp(prefix="tinygpt-browser-"))
    folder = work / "notebooks"
    shutil.copytree(
        ROOT / "notebooks", folder
    )  # a copy: the committed notebooks stay without outputs
    server, url = start_server(folder, work)
    driver, seen = None, {}
    try:
        driver = chromium(work)
        for name in names:
            t0 = time.monotonic()
            nb = Notebook(driver, url.format(name=name), folder / name)
            if name.startswith("00"):
                nb.run()
                seen[name] = {"hardware": nb.text("hardware"), "recipes": nb.text("recipes")}
                nb.screenshot("hardware", "recipes", out / "setup.png")
            elif name.startswith("01"):
                seen[name] = pretrain(nb, out)
            elif name.startswith("02"):
                nb.run()
                seen[name] = {
                    "recipe": nb.text("recipe"),
                    "train": nb.text("train"),
                    "generations": nb.text("generations"),
                }
                nb.screenshot("train", "generations", out / "finetune.png")
            elif name.startswith("03"):
                nb.run()
                seen[name] = {
                    "curves": len(nb.output("curves").find_elements("css selector", "img")),
                    "table": nb.text("table"),
                    "perplexity": nb.text("perplexity"),
                }
                nb.screenshot("perplexity", "hellaswag", out / "evaluate-scores.png")
                nb.screenshot("curves", "table", out / "evaluate-runs.png")
            # every red box (stderr: warnings, tracebacks) the page shows, and every table too wide for its frame
            seen[name]["stderr"] = nb.js(
                "return [...document.querySelectorAll('.output_stderr')].map(e => e.innerText)"
            )
            seen[name]["overflowing_tables"] = nb.js(
                "return [...document.querySelectorAll('.output_area table')].filter(t => t.getBoundingClientRect()"
                ".right > t.closest('.output_subarea').getBoundingClientRect().right + 1).map(t => t.innerText"
                ".slice(0, 80))"
            )
            seen[name]["text"] = nb.js(
                "return [...document.querySelectorAll('.output_area')]"
                ".map(e => e.innerText).join('\\n')"
            )
            seen[name]["seconds"] = round(time.monotonic() - t0, 1)
            driver.get("about:blank")
        (out / "observations.json").write_text(json.dumps(seen, indent=1))
        return seen
    except Exception:  # what the page showed, for whoever reads the failure
        if driver is not None:
            (out / "failure.html").write_text(driver.page_source)
            (out / "failure-console.txt").write_text(
                "\n".join(str(e) for e in driver.get_log("browser"))
            )
            driver.save_screenshot(str(out / "failure.png"))
        raise
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(30)
        shutil.rmtree(work, ignore_errors=True)


ALL = ["00_setup.ipynb", "01_pretrain.ipynb", "02_finetune.ipynb", "03_evaluate.ipynb"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=Path, help="write the screenshots here (docs/images)")
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--notebooks", nargs="*", default=ALL)
    args = ap.parse_args()
    if args.inside:
        run_notebooks(args.out, args.notebooks)
        return
    if (why := missing_browser()) is not None:
        sys.exit(why)
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import SHARED_DATA, build_stand_in
    from test_notebooks import Colab

    with tempfile.TemporaryDirectory() as tmp:
        data = SHARED_DATA if SHARED_DATA.is_dir() else build_stand_in(Path(tmp) / "data")
        env = Colab(Path(tmp)).env() | {"TINYGPT_SHARED_DATA": str(data)}
        seen = run_in_browser(env, args.images, args.notebooks)
    (args.images / "observations.json").unlink()
    print(json.dumps({k: v["seconds"] for k, v in seen.items()}))


if __name__ == "__main__":
    main()
