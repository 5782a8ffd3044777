from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
version = next(line.split('"')[1] for line in (here / "tinygpt" / "__init__.py").read_text().splitlines()
               if line.startswith("__version__"))

# torch is a range, never a pin: Colab already has a CUDA build that must not be replaced.
install_requires = ["torch>=2.4", "numpy>=1.24", "tokenizers>=0.15", "safetensors>=0.4", "tqdm>=4.60"]
extras = {
    "hf": ["transformers>=4.45", "datasets>=2.18"],
    "finetune": ["transformers>=4.45", "peft>=0.12", "bitsandbytes>=0.43; platform_system != 'Darwin'",
                 "datasets>=2.18"],
    "eval": ["sacrebleu>=2.3", "transformers>=4.45", "matplotlib>=3.6"],
    # GGUF for llama.cpp / Ollama (llama.cpp's own writer) and `tinygpt push` to the Hugging Face Hub
    "export": ["gguf>=0.16", "huggingface_hub>=0.24", "transformers>=4.45"],
    # Colab preinstalls ipywidgets 7.7.1 and its front end renders no ipywidgets 8: never upgrade it.
    # The GPU recipes stream Hub data (datasets) and use the GPT-2 tokenizer (transformers); Colab has both
    "notebooks": ["ipywidgets>=7.7.1", "matplotlib>=3.6", "pandas>=1.5", "datasets>=2.18", "transformers>=4.45"],
}
extras["dev"] = sorted({d for v in extras.values() for d in v} | {"pytest>=7", "pytest-xdist>=3", "nbmake>=1.5",
                                                                   "ipykernel>=6", "tensorboard>=2.10",
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
