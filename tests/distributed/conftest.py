import pytest

from .models import write_all
from .pool import close_all_pools


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """Every reference model's tiny checkpoint, written once per session."""
    return write_all(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    close_all_pools()
