try:
    from avpipe.cli import main
except KeyboardInterrupt:  # Ctrl-C while the command's modules are imported: no traceback
    raise SystemExit(130) from None

raise SystemExit(main())
