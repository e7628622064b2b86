from mindloom_data._cli import main

raise SystemExit(main())
