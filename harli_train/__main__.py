from harli_train.cli import main

main()
