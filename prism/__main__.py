from prism.cli import main

raise SystemExit(main())
