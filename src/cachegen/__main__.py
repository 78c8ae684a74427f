import sys

from cachegen.cli.main import main

sys.exit(main())
