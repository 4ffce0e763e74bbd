from services.openai_door.service import main

main()
