"""The ClientApp: each node answers with its own rows (``fedapp.data.load``).

The methods are named, not imported: a deployed SuperNode starts a new process for every
message, and only a node's first message of a run imports them (and NumPyro with them) to
rebuild the client program; later messages run the functions the node stored then.
"""

from fedapp.data import load
from numpyro_fed import flower

app = flower.client_app("fedapp.task:METHODS", load)
