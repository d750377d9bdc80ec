from dynmo_hpc.cli import main

raise SystemExit(main())
