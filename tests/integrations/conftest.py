import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one thread is several times faster than torch's default on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
