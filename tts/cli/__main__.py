import sys

from tts.cli.main import main

sys.exit(main())
