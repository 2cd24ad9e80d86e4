"""The filter's own tests run on both event loops: uvloop (the default, when installed) and
asyncio's loop (the fallback). The same code has to be right on each: they differ in what
a transport's socket allows, and in when callbacks run."""

from __future__ import annotations

import pytest

from tests.integration.conftest import FilterProcess


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def corral_filter(internet, tmp_path_factory, request):
    process = FilterProcess(tmp_path_factory.mktemp("filter"), internet.dns.address,
                            event_loop=request.param)
    yield process
    process.stop()
