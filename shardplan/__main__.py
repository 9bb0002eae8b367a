from shardplan.cli.app import main_exit

main_exit()
