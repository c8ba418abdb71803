from tether._cli.app import main

main()
