"""The ClientApp: each node rebuilds the methods' client programs from this app's code and
answers with its own rows (fedapp.task.load)."""

from fedapp.task import METHODS, load
from numpyro_fed import flower

app = flower.client_app(METHODS, load)
