"""Prefect flows over xbn's stages (the same functions `dvc repro` runs through the CLI)."""
