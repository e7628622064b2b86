from mindloom_tokenizer._cli import main

raise SystemExit(main())
