from train.cli import entry

entry()
