import sys

from shoestring.cli import main

sys.exit(main())
