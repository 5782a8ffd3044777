from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
version = next(
    line.split('"')[1]
    for line in (here / "tinygpt" / "__init__.py").read_text().splitlines()
    if line.startswith("__version__")
)

# torch is a range, never a pin: Colab already has a CUDA build that must not be
# replaced. Every lower bound is a version the suite passes on: CI runs it on the newest
# releases and on Google Colab's Python and preinstalled versions (constraints/colab.txt:
# Python 3.13, torch 2.11, transformers 5.15, peft 0.20 since 2026-08), so the floors are
# Colab's versions. The code itself needs torch 2.9 (SDPA's enable_gqa, 2.5;
# torch.optim.Muon, 2.9), but no older torch than Colab's is tested any more.
install_requires = [
    "torch>=2.11",
    "numpy>=2.1.3",
    "tokenizers>=0.22.2",
    "safetensors>=0.8.0",
    "tqdm>=4.67.3",
]
extras = {
    "hf": ["transformers>=5.15", "datasets>=4.0"],
    # bitsandbytes is not on Colab until installed; 0.46 is the first whose 4-bit layers compile
    # without graph breaks (with torch >= 2.8) and transformers 5.x asks for 0.46.1;
    # constraints/floors.txt holds CI's Colab run at exactly that version
    "finetune": [
        "transformers>=5.15",
        "peft>=0.20",
        "bitsandbytes>=0.46.1; platform_system != 'Darwin'",
        "datasets>=4.0",
    ],
    "eval": ["sacrebleu>=2.3", "transformers>=5.15", "matplotlib>=3.10"],
    # GGUF for llama.cpp / Ollama (llama.cpp's own writer, 0.19: the version tested) and `tinygpt
    # push` to the Hugging Face Hub (Colab's huggingface_hub)
    "export": ["gguf>=0.19", "huggingface_hub>=1.27.0", "transformers>=5.15"],
    # Colab preinstalls ipywidgets 7.7.1 and its front end renders no
    # ipywidgets 8: never upgrade it. The GPU recipes stream Hub data
    # (datasets) and use the GPT-2 tokenizer (transformers); Colab has both
    "notebooks": [
        "ipywidgets>=7.7.1",
        "matplotlib>=3.10",
        "pandas>=2.2.3",
        "datasets>=4.0",
        "transformers>=5.15",
    ],
}
extras["dev"] = sorted(
    {d for v in extras.values() for d in v}
    | {
        "pytest>=7",
        "pytest-xdist>=3",
        "nbmake>=1.5",
        "ipykernel>=6.17.1",
        "tensorboard>=2.10",
        # the tests build a wheel
        # (bdist_wheel)
        "setuptools>=70.1",
        "wheel>=0.40",
        # the layers contract and the
        # linter (CI)
        "import-linter>=2.0",
        "ruff>=0.6",
    }
)
# GPT-2 token caches at 3.5x the speed of tokenizers (Colab has 0.14.0)
install_requires.append("tiktoken>=0.14.0")

setup(
    name="tinygpt",
    version=version,
    description="Train small GPT language models in Colab notebooks, on any GPU, with exact resume",
    long_description=(here / "README.md").read_text(encoding="utf-8")
    if (here / "README.md").exists()
    else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tinygpt", "tinygpt.*"]),
    # the GPT-2 BPE files (MIT); small data samples for offline examples (tinygpt/samples/README.md:
    # licences); the size planner's fitted scaling laws (benchmarks/fit_scaling.py writes them)
    package_data={
        "tinygpt.model": ["assets/*.json", "assets/*.txt"],
        "tinygpt.fit": ["scaling_laws.json"],
        "tinygpt": [
            "samples/*.md",
            "samples/*.txt",
            "samples/*.bz2",
            "samples/*.jsonl",
            "samples/*.gz",
        ],
    },
    # 3.11: typing.Self (core/config.py) and this machine's python3, CI's newest suite; 3.13:
    # Colab's, CI's Colab suite
    python_requires=">=3.11",
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
    ],
    install_requires=install_requires,
    extras_require=extras,
    entry_points={"console_scripts": ["tinygpt=tinygpt.__main__:run"]},
)
