"""conftest.require: a launcher tool that is missing fails the test where `make test` could have
installed it (root with apt-get), and skips with the install command everywhere else."""

import conftest
import pytest

TOOL = "no-such-launcher-tool-for-this-test"


def test_missing_where_make_test_installs_is_a_failure(monkeypatch):
    monkeypatch.setattr(conftest, "can_install_system_packages", lambda: True)
    monkeypatch.delenv("DDP_CIFAR_ALLOW_MISSING", raising=False)
    with pytest.raises(pytest.fail.Exception, match=f"{TOOL} not found: sudo apt-get install x"):
        conftest.require(TOOL, "sudo apt-get install x")


@pytest.mark.parametrize("can_install, allow", [(False, None), (True, "1")], ids=["not-root", "allow-missing"])
def test_missing_elsewhere_or_when_allowed_skips_with_the_install_command(can_install, allow, monkeypatch):
    monkeypatch.setattr(conftest, "can_install_system_packages", lambda: can_install)
    if allow:
        monkeypatch.setenv("DDP_CIFAR_ALLOW_MISSING", allow)
    with pytest.raises(pytest.skip.Exception, match="sudo apt-get install x .make test does this when it runs as root"):
        conftest.require(TOOL, "sudo apt-get install x")


def test_a_present_tool_is_found_and_its_path_returned():
    assert conftest.require("sh", "never needed").endswith("/sh")
