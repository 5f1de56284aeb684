from serve.launch import main

main()
