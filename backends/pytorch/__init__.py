"""TorchScript backend (platform `pytorch_libtorch`, backend `pytorch`); needs pier[torch]."""
