"""`pip check`, failing on every problem but the few known ones listed in pip-check-allowed.txt.

The list names each line exactly as pip prints it, with the reason beside it; a line not on it fails
(exit 1), and the known ones are printed as such so they stay visible.

    python infra/python/pip_check.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ALLOWED_FILE = Path(__file__).with_name("pip-check-allowed.txt")


def allowed_lines(path: Path = ALLOWED_FILE) -> set[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("#")}


def unexpected_problems(report: str, allowed: set[str]) -> list[str]:
    """The lines of `pip check`'s output that the allow-list does not name."""
    return [line for line in (line.strip() for line in report.splitlines()) if line and line not in allowed]


def main() -> int:
    result = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    if result.returncode == 0:  # "No broken requirements found."
        return 0
    report = result.stdout + result.stderr
    allowed = allowed_lines()
    unexpected = unexpected_problems(report, allowed)
    known = [line for line in report.splitlines() if line.strip() in allowed]
    if known:
        print(f"pip check: known and allowed ({ALLOWED_FILE.name}):\n  " + "\n  ".join(known))
    if unexpected:
        print("pip check failed:\n  " + "\n  ".join(unexpected), file=sys.stderr)
        return 1
    return 0 if known else 1


if __name__ == "__main__":
    sys.exit(main())
