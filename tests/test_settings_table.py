"""docs/SETTINGS.md is what scripts/settings_table.py writes from the settings' declarations: a field added, renamed
or documented anew without regenerating it fails here."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_settings_md_is_generated_from_the_declarations():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "settings_table.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    table = (ROOT / "docs" / "SETTINGS.md").read_text()
    assert "| `kv_budget_tokens` |" in table and "| `target` |" in table
