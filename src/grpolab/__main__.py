from grpolab.cli import main

raise SystemExit(main())
