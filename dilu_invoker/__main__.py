from dilu_invoker.cli import main

raise SystemExit(main())
