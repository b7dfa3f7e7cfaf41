from sciproto.cli import main

main()
