from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
version = next(line.split('"')[1] for line in (here / "tinygpt" / "__init__.py").read_text().splitlines()
               if line.startswith("__version__"))

# torch is a range, never a pin: Colab already has a CUDA build that must not be replaced.
# Every lower bound is a version the suite passes on: CI runs it on the newest releases and on Google Colab's
# preinstalled versions (constraints/colab.txt), so the floors are Colab's versions. torch 2.9 is also what the
# code needs: SDPA's enable_gqa (2.5) and torch.optim.Muon (2.9).
install_requires = ["torch>=2.9", "numpy>=2.0.2", "tokenizers>=0.22.1", "safetensors>=0.6.2", "tqdm>=4.67.1"]
extras = {
    "hf": ["transformers>=5.0", "datasets>=4.0"],
    # bitsandbytes is not on Colab until installed; 0.46 is the first whose 4-bit layers compile without graph
    # breaks (with torch >= 2.8) and transformers 5.0 asks for 0.46.1; constraints/floors.txt holds CI's Colab
    # run at exactly that version
    "finetune": ["transformers>=5.0", "peft>=0.18", "bitsandbytes>=0.46.1; platform_system != 'Darwin'",
                 "datasets>=4.0"],
    "eval": ["sacrebleu>=2.3", "transformers>=5.0", "matplotlib>=3.10"],
    # GGUF for llama.cpp / Ollama (llama.cpp's own writer, 0.19: the version tested) and `tinygpt push` to the
    # Hugging Face Hub (Colab's huggingface_hub)
    "export": ["gguf>=0.19", "huggingface_hub>=1.3.4", "transformers>=5.0"],
    # Colab preinstalls ipywidgets 7.7.1 and its front end renders no ipywidgets 8: never upgrade it.
    # The GPU recipes stream Hub data (datasets) and use the GPT-2 tokenizer (transformers); Colab has both
    "notebooks": ["ipywidgets>=7.7.1", "matplotlib>=3.10", "pandas>=2.2.2", "datasets>=4.0", "transformers>=5.0"],
}
extras["dev"] = sorted({d for v in extras.values() for d in v} | {"pytest>=7", "pytest-xdist>=3", "nbmake>=1.5",
                                                                   "ipykernel>=6.17.1", "tensorboard>=2.10",
                                                                   # the tests build a wheel (bdist_wheel)
                                                                   "setuptools>=70.1", "wheel>=0.40",
                                                                   # the layers contract and the linter (CI)
                                                                   "import-linter>=2.0", "ruff>=0.6"})

setup(
    name="tinygpt",
    version=version,
    description="Train small GPT language models in Colab notebooks, on any GPU, with exact resume",
    long_description=(here / "README.md").read_text(encoding="utf-8") if (here / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tinygpt", "tinygpt.*"]),
    package_data={"tinygpt.model": ["assets/*.json", "assets/*.txt"]},  # the GPT-2 BPE files (MIT)
    python_requires=">=3.10",
    install_requires=install_requires,
    extras_require=extras,
    entry_points={"console_scripts": ["tinygpt=tinygpt.cli:main"]},
)
