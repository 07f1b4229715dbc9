"""The README's `make demo` job runs and proves a bit-identical resume."""

import subprocess
import sys
from pathlib import Path


def test_demo_resumes_bit_identically(tmp_path):
    script = Path(__file__).resolve().parent.parent / "examples" / "demo.py"
    result = subprocess.run([sys.executable, str(script), "--storage", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "bit-identical to an uninterrupted run: True" in result.stdout
