from mindloom_monitor import __version__
from mindloom_monitor._cli import main


def test_version_flag_prints_the_package_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exc:  # argparse's version action exits 0
        assert exc.code == 0
    assert __version__ in capsys.readouterr().out
