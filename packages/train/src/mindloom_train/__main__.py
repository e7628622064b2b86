"""`python -m mindloom_train` runs the `mindloom` command."""

from mindloom_train._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
