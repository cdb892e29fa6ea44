"""cring's version, in one place: the wheel (pyproject.toml reads it), `cring.__version__`,
`cringrun --version` and the build report. A leaf module: it imports nothing, so the
launcher and the report can read it without importing the package's API."""

__version__ = "0.1.0"
