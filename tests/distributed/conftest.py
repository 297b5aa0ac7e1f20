import pytest

from .pool import close_all_pools


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    close_all_pools()
