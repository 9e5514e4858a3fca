"""lit configuration: RUN lines use hlopar-opt and FileCheck from the environment running lit.

One folder per pass, named as the pass without `hlopar-` (`split-microbatches/`); `hlopar-opt/`
and `hlopar-compile/` test the command lines themselves, `dialect/` hlopar's MPMD program form
parsed, verified and printed back with no pass. Every `.mlir` under this folder is a test.
"""

import os
import shutil
import sys

import lit.formats

config.name = "hlopar"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".mlir"]
config.test_source_root = os.path.dirname(__file__)
config.excludes = ["Inputs", "lit.cfg.py"]

# Tools come from the virtual environment lit runs in (pip puts them beside python).
bin_dir = os.path.dirname(sys.executable)
config.environment["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
# PYTHONPATH: tools/mutation_check.py points hlopar-opt at a mutated copy of the package.
for variable in ("HOME", "TMPDIR", "PYTHONPATH"):
    if variable in os.environ:
        config.environment[variable] = os.environ[variable]

# `FileCheck` is LLVM's name; the `filecheck` package on PyPI is a compatible port.
filecheck = shutil.which("FileCheck", path=config.environment["PATH"]) or shutil.which(
    "filecheck", path=config.environment["PATH"]
)
if filecheck is None:
    lit_config.fatal("FileCheck not found: install the project (pip install -e .) or LLVM's FileCheck")
config.substitutions.append((r"\bFileCheck\b", filecheck))
config.substitutions.append(("%inputs", os.path.join(config.test_source_root, "Inputs")))
# %corpus: the shared corpus, where hlopar.corpus finds it (HLOPAR_CORPUS, default ../shared/corpus).
sys.path.insert(0, os.path.dirname(os.path.dirname(config.test_source_root)))
from hlopar.corpus import corpus_dir  # noqa: E402

config.substitutions.append(("%corpus", str(corpus_dir())))
config.substitutions.append(("%python", sys.executable))
