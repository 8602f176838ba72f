import sys

from shardstack.cli import main

sys.exit(main())
