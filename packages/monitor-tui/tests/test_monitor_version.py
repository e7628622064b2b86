import pytest
from mindloom_monitor import __version__
from mindloom_monitor._cli import main


def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert __version__ in capsys.readouterr().out
