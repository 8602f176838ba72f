import pytest


def pytest_configure(config: pytest.Config) -> None:
    # torch.distributed.optim scripts its functional optimizers at import; the deprecation is torch's, not ours.
    config.addinivalue_line("filterwarnings", r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")
