try:
    from grpolab.cli import main
except KeyboardInterrupt:  # Ctrl-C while Python reads the command line's module
    import sys

    print("grpolab: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
