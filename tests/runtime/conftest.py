import pytest

from distributed.pool import close_all_pools  # tests/ is on sys.path (tests/conftest.py)


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    close_all_pools()
