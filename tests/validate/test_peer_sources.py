"""The peers' loading machinery leaves nothing behind: the temporary folders it makes (shims, a wheel's
extracted kernel files) are gone when the process that made them exits."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_CHILD = """
import sys
from pathlib import Path
from kvbuffer.peers._sources import extract, write_shims
shims = write_shims("kvbuffer-test-shims-", {"pkg/__init__.py": "X = 1\\n"})
root = extract(Path(sys.argv[1]), [r"pkg/.*"], "kvbuffer-test-wheel-")
assert (shims / "pkg" / "__init__.py").read_text() == "X = 1\\n"
assert (root / "pkg" / "mod.py").read_text() == "Y = 2\\n"
print(shims)
print(root)
"""


def test_shims_and_extracted_wheels_are_removed_when_the_process_exits(tmp_path):
    whl = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("pkg/mod.py", "Y = 2\n")
        z.writestr("other/skip.py", "")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(whl)], capture_output=True, text=True, env=env,
                         timeout=110)
    assert out.returncode == 0, out.stderr
    made = [Path(p) for p in out.stdout.split()]
    assert len(made) == 2 and all(p.name.startswith("kvbuffer-test-") for p in made)
    assert not any(p.exists() for p in made), f"left behind: {[p for p in made if p.exists()]}"
