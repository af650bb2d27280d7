"""What every test shares."""

import pytest


@pytest.fixture(autouse=True)
def own_preflight_cache(tmp_path_factory, monkeypatch):
    """Each test remembers passing preflights in a directory of its own (the commands it
    starts inherit it), so no test reuses another's pass or the user's."""
    monkeypatch.setenv("GRPOLAB_PREFLIGHT_CACHE", str(tmp_path_factory.mktemp("preflight-cache")))
