"""Ships ``kvmem_sglang.pth`` beside the package (site-packages), so that with
``SGLANG_KVMEM=1`` an sglang process that did not load the plugin stops instead of
running stock (kvmem_sglang/startup.py).  Everything else is in pyproject.toml.  An
editable install (``pip install -e``) does not carry the .pth file."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "kvmem_sglang.pth"


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": build_py_with_pth})
