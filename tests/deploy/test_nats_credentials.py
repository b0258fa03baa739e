"""The credentials Job's script: passwords and URLs are added once and never changed."""

from __future__ import annotations

import importlib.util
import re
from types import ModuleType
from urllib.parse import urlsplit

from tests.deploy.manifests import K8S

SCRIPT = K8S / "base" / "nats" / "nats_credentials.py"


def credentials_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nats_credentials", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_new_secret_gets_a_password_per_user_and_a_url_per_service() -> None:
    module = credentials_module()
    entries = module.missing_entries({}, "vgpu-nats:4222")
    passwords = [entries[key] for key in module.PASSWORD_KEYS]
    assert len(set(passwords)) == len(passwords)
    for password in passwords:
        # Never read as a number or size by the NATS config, and safe in a URL.
        assert re.fullmatch(r"p[0-9a-f]{48}", password), password
    url = urlsplit(entries["allocator-url"])
    assert (url.scheme, url.hostname, url.port) == ("nats", "vgpu-nats", 4222)
    assert (url.username, url.password) == ("vgpu-allocator", entries["allocator-password"])
    assert urlsplit(entries["nodeagent-url"]).username == "vgpu-node-agent"
    assert urlsplit(entries["metrics-url"]).username == "vgpu-metrics"


def test_existing_entries_are_kept_and_only_missing_ones_added() -> None:
    module = credentials_module()
    first = module.missing_entries({}, "vgpu-nats:4222")
    assert module.missing_entries(first, "vgpu-nats:4222") == {}
    partial = {k: v for k, v in first.items() if k != "metrics-url"}
    added = module.missing_entries(partial, "vgpu-nats:4222")
    # The URL is rebuilt with the password that is already in use.
    assert added == {"metrics-url": first["metrics-url"]}
    operator_urls = {"allocator-url": "tls://a:b@nats.example:4222"}
    assert "allocator-url" not in module.missing_entries(operator_urls, "vgpu-nats:4222")


def test_passwords_are_fresh_each_time() -> None:
    module = credentials_module()
    assert module.new_password() != module.new_password()
