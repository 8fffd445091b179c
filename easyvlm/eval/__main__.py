from easyvlm.eval.run import main

main()
