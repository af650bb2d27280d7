try:
    from grpolab.commands.cli import main
except KeyboardInterrupt:  # Ctrl-C while Python reads the command line's module
    import os
    import sys

    print("grpolab: interrupted", file=sys.stderr)
    sys.stderr.flush()
    os._exit(130)

raise SystemExit(main())
