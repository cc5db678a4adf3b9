"""Packaging that pyproject.toml cannot say: the trained drafts under checkpoints/ ship inside
the package as `jaxinfer.checkpoints`, so `pip install` (not only an editable checkout) has them."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["jaxinfer*", "pallas_kernels*"]) + ["jaxinfer.checkpoints"],
      package_dir={"jaxinfer.checkpoints": "checkpoints"},
      package_data={"jaxinfer.checkpoints": ["*.md", "*/*.json", "*/params/**/*"]})
