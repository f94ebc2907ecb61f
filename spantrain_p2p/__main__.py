"""``python -m spantrain_p2p peer …`` runs spantrain-peer; anything else is the spantrain tool."""
import sys

from .cli.main import main
from .peer_command.main import main as peer_main

if len(sys.argv) > 1 and sys.argv[1] == "peer":
    sys.exit(peer_main(sys.argv[2:]))
sys.exit(main(sys.argv[1:]))
