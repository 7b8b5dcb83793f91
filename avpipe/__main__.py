from avpipe.cli import main

raise SystemExit(main())
