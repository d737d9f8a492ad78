"""Install prism-megatron: `pip install -e .[test]` (see README for the two commands)."""

import runpy
from pathlib import Path

from setuptools import find_packages, setup

# The supported megatron-core releases are stated once, in the package (loaded by path: nothing is installed yet).
_versions = runpy.run_path(str(Path(__file__).parent / "prism_megatron" / "megatron" / "versions.py"))
MEGATRON_CORE = _versions["requirement"]()

setup(
    name="prism-megatron",
    version="0.1.0",
    description="Faithful emulation of large-scale Megatron-Core training on a few GPUs",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["prism_megatron", "prism_megatron.*", "nccl_prune", "nccl_prune.*"]),
    package_data={"prism_megatron.recipes": ["**/*.yaml"]},  # the shipped recipes and cluster profiles
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
        "megatron": [MEGATRON_CORE],
        "te": ["transformer-engine[pytorch]"],
        # setuptools >= 70.1 builds wheels itself (no `wheel` package): the packaging test builds one
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.6", "ruff>=0.6", "setuptools>=70.1",
                 MEGATRON_CORE],
    },
    entry_points={"console_scripts": ["prism-megatron=prism_megatron.cli:main"]},
)
