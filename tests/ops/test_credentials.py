"""Controller-side secrets live beside the inventory and must never be read back as inventory."""

from pathlib import Path

import yaml
from ansible import constants as C

ROOT = Path(__file__).resolve().parents[2]


def test_token_store_is_ignored_when_the_inventory_is_a_directory() -> None:
    # A directory inventory (molecule's, or `-i inventory/prod/`) is parsed file by file; a bare token would be
    # read as a host named after the secret.
    store = yaml.safe_load((ROOT / "roles/inference_service/defaults/main.yml").read_text())[
        "inference_service_token_store"]
    ignored = C.INVENTORY_IGNORE_EXTS
    assert any(store.endswith(ext) for ext in ignored), (store, ignored)
