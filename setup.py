"""Install prism-megatron: `pip install -e .[test]` (see README for the two commands)."""

from setuptools import find_packages, setup

setup(
    name="prism-megatron",
    version="0.1.0",
    description="Faithful emulation of large-scale Megatron-Core training on a few GPUs",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["prism_megatron", "prism_megatron.*", "nccl_prune", "nccl_prune.*"]),
    install_requires=[
        "torch>=2.4",
        "pyyaml>=6",
        "click>=8.1",
        "pyarrow>=14",
        "rich>=13",
        "wandb>=0.17",
        "nvidia-ml-py>=12",
    ],
    extras_require={
        "megatron": ["megatron-core>=0.16,<0.20"],
        "te": ["transformer-engine[pytorch]"],
        "test": ["pytest>=8", "pytest-timeout>=2.3", "ruff>=0.6", "megatron-core>=0.16,<0.20"],
    },
    entry_points={"console_scripts": ["prism-megatron=prism_megatron.cli:main"]},
)
