import sys

from pcp_tui.app.cli import main

sys.exit(main())
