"""Build step: ship the device headers, templates and wave orders inside the
wheel (``megac/_data/``), where :mod:`megac.resources` finds them when megac
is installed without its repository. Everything else is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
DATA = ("opcodes", "templates", "schedules")


class BuildWithData(build_py):
    def run(self):
        super().run()
        for name in DATA:
            dst = Path(self.build_lib) / "megac" / "_data" / name
            if dst.exists():
                shutil.rmtree(dst)
            shutil.copytree(ROOT / name, dst, ignore=shutil.ignore_patterns("__pycache__", "*.cubin"))


setup(cmdclass={"build_py": BuildWithData})
