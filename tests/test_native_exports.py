"""tidekv._native exports its module init alone (native/extension.map).

On the H200 hosts' image the toolchain links libstdc++ statically; without the version script the
extension exported libstdc++'s locale-facet ids as unique symbols, the loader bound torch's
libstdc++ to them, and `import torch` after a TransferEngine existed crashed (2026-12-04). The
crash needs that toolchain and CUDA torch; what prevents it, the export table, is checked here.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tidekv import _native


def test_the_extension_exports_only_its_module_init() -> None:
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run(["nm", "-D", "--defined-only", _native.__file__], check=True, capture_output=True, text=True)
    symbols = sorted(line.split()[-1] for line in out.stdout.splitlines() if line.strip())
    assert symbols == ["PyInit__native"], f"{_native.__file__} exports more than its init: {symbols[:20]}"
